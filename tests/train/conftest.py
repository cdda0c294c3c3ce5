import os
import sys

# the spawning helpers (launch.py) sit beside the tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
