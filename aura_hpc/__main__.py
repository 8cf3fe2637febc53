import sys

from aura_hpc.cli import main

sys.exit(main())
