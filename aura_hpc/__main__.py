from aura_hpc.cli import main
from aura_hpc.errors import exit_process

exit_process(main())
