"""One exception type for bad user input: printed as a single line, non-zero exit."""


class UserError(Exception):
    """A problem with the config, mesh, data or a checkpoint that the user must fix."""
