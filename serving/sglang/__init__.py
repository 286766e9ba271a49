"""SGLang: its side of the serving contract (what it reads from a draft folder and its launch command)."""
