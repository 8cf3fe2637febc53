#!/bin/sh
# The image's entry point: `docker compose run --rm trainer local ...` runs `python -m aura_hpc local ...`;
# anything else (`trainer nvidia-smi`, `trainer bash -lc "..."`) runs as given. The list is the CLI's
# commands (tests/test_containers.py checks it); `ps` is aura_hpc's parameter server, not procps.
case "${1:-}" in
  ""|-*|local|submit|ps|worker|status|logs|cancel|history|check|monitor|prepare|generate|config|selftest)
    exec python -m aura_hpc "$@" ;;
  *)
    exec "$@" ;;
esac
