import sys

from aura_hpc.train.worker import main

sys.exit(main())
