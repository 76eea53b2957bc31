"""How ranks exist and run: worlds of rank processes, their protocol, the modes."""
