"""The work itself, as plain typed functions a flow (or a test, or a study) calls: one package per stage."""
