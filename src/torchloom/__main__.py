"""``python -m torchloom``: the command line."""

from .apps.cli import main

if __name__ == "__main__":
    main()
