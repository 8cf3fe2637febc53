from aura_hpc.train.process.startup_gc import imports_unscanned

with imports_unscanned():
    from aura_hpc.errors import exit_process
    from aura_hpc.train.checkpoint import background
    from aura_hpc.train.worker import main

status = main()
background.close()
exit_process(status)
