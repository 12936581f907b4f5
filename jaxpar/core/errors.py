"""One exception type for bad user input: printed as a single line, non-zero exit."""


class UserError(Exception):
    """A problem with the config, mesh, data or a checkpoint that the user must fix."""


def cli(main):
    """Decorate a command's `main(argv) -> int`: a UserError becomes one `error:` line, exit status 2."""
    import functools
    import sys

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run
