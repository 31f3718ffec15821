import pathlib
import sys

# Import the package from this checkout, not from an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
