"""build-engines: checkpoint -> export -> quantize -> evaluate -> bundle."""
