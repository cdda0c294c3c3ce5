"""pyproject.toml reads without setuptools' deprecation warnings: the license is an SPDX string
(PEP 639), which setuptools takes from version 77 on, so the build requires at least that."""
import pathlib
import re
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_reads_without_warnings_and_states_an_spdx_license():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    # setuptools' own warnings (its deprecations of pyproject fields among them); a DeprecationWarning
    # of distutils, raised when the first import of it in this process happens here, is not one
    from setuptools.warnings import SetuptoolsWarning
    said = [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, SetuptoolsWarning)]
    assert not said, f"setuptools warns about pyproject.toml: {said}"
    assert dist.metadata.license_expression == "Apache-2.0"


def test_the_build_requires_a_setuptools_that_reads_spdx_licenses():
    text = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+, we take 3.10
    section = re.search(r"^\[build-system\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M).group(1)
    req = re.findall(r'"([^"]+)"', re.search(r"^requires\s*=\s*\[(.*?)\]", section, re.S | re.M).group(1))
    st = [r for r in req if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", st[0].replace(" ", "")) if st else None
    assert m and int(m.group(1)) >= 77, f"build-system.requires: {req}; an SPDX license string needs setuptools>=77"
