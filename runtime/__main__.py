import sys

from runtime.cli import main

if __name__ == "__main__":  # the engine process is spawned: it imports this module without running it
    sys.exit(main())
