"""Delta codec: only the changed words of a version, against a base both ends hold."""
