from orchestrator.cli import entry

if __name__ == "__main__":  # not when a spawned process (parallel estimates) re-imports this module
    raise SystemExit(entry())
