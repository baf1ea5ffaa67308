"""`python -m effkit` and the `effkit` command. The libraries load inside the guard, so Ctrl-C in the first
second ends in one line like everywhere else."""


def main() -> None:
    try:
        from effkit.cli import main as cli_main
    except KeyboardInterrupt:
        from effkit.errors import exit_interrupted

        exit_interrupted()
    cli_main()


if __name__ == "__main__":
    main()
