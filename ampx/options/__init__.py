"""ampx's options: opt levels as data and every default (`levels`), single-value parsers (`values`),
and the argparse flags (`flags`)."""
