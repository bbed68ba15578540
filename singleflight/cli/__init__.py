"""Front ends: they parse, call one core function, and map errors to exit codes."""
