"""`python -m effkit` and the `effkit` command. The libraries load inside the guard, so Ctrl-C in the first
second ends in one line like everywhere else."""


def main() -> None:
    import sys

    from effkit.errors import EffkitError, exit_interrupted, interrupt_received, watch_interrupts

    watch_interrupts()
    try:
        from effkit.cli import main as cli_main
    except KeyboardInterrupt:
        exit_interrupted()
    except EffkitError as e:  # e.g. a plug-in named in $EFFKIT_PLUGINS that does not import: one line, exit 2
        print(f"effkit: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception:
        if interrupt_received():  # Ctrl-C inside a C extension's import surfaces as its own error
            exit_interrupted()
        raise
    cli_main()


if __name__ == "__main__":
    main()
