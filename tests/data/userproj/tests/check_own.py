"""The project's own tests, run beside the items flashcheck's pytest plugin adds."""

from pathlib import Path

import flashcheck.verify

import kernels
import reference
import verify

PROJECT = Path(__file__).resolve().parents[1]


def test_own_packages_are_the_projects():
    for pkg in (kernels, reference, verify):
        assert pkg.USERPROJ_OWN is True
        assert Path(pkg.__file__).resolve().parent.parent == PROJECT


def test_flashcheck_is_not_from_this_project():
    assert PROJECT not in Path(flashcheck.verify.__file__).resolve().parents
