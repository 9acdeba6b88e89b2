"""Test-wide setup: import the code under test from this checkout, and tests/helpers."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The checkout first: a stale installed copy must not shadow the code being tested.
# (Tests that spawn twistd use the installed copy; `make test` installs it first.)
sys.path[:0] = [os.path.dirname(HERE), HERE]
