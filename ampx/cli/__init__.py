"""The `ampx` command line: `main` (parser, dispatch), `run`, `info`, `lists`, `selftest`,
`sweep`."""
