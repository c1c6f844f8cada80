"""``python -m flashtune ...``: the ``flashtune`` command without an installed entry point."""

from flashtune.cli.main import cli

if __name__ == "__main__":
    cli(prog_name="flashtune")
