"""Online benchmarks: speed and acceptance measured over HTTP against running servers, or on engines started here."""
