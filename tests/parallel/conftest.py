import sys
from pathlib import Path

# The rank scripts beside these tests are imported by name, here and in spawned ranks (which
# inherit sys.path); pytest's importlib mode does not put this folder on the path itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
