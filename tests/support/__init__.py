"""Test support shared by several test folders, imported as ``tests.support.<module>`` (``tests/conftest.py``
puts the repository root on ``sys.path``)."""
