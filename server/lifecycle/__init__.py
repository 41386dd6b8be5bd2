"""The process: loading models behind a bound server, launch, drain, metrics, server state."""
