"""Research studies: questions about the method (how acceptance scales, which selection wins, whether the layer mapping is right), answered on the embedded target."""
