"""Rehearsals: the production run at its real size on one machine, with scripted servers in place of the target."""
