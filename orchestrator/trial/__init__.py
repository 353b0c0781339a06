"""The Tune runtime: what runs inside a trial's Ray worker (one process, or every rank of a group)."""
