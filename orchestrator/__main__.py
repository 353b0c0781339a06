from orchestrator.cli import main

if __name__ == "__main__":  # not when a spawned process (parallel estimates) re-imports this module
    raise SystemExit(main())
