"""The sample project's own ``kernels`` package, named like one of flashcheck's subpackages.

flashcheck installs only the name ``flashcheck``; a kernel repository may have top-level
packages of its own with generic names. mod.py and tests/check_own.py check that the
``kernels`` they import is this one (the marker below) and that flashcheck never took the
name.
"""

USERPROJ_OWN = True
