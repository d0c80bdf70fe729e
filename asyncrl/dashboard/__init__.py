"""The live web dashboard: ``python -m asyncrl.dashboard RUN_DIR_OR_ENDPOINT`` (see `server`)."""
