"""The release's own checks (build_tools/release.py): the local package index pip installs from
by name, and the sdist's contents."""

import hashlib
import io
import re
import tarfile

import pytest

from build_tools import release

pytestmark = pytest.mark.dev_tool


def _sdist(path, members: list[str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            info = tarfile.TarInfo(f"torch_kvcanary-0.1.0/{member}")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))


def test_the_index_links_each_file_by_its_sha256_under_the_normalized_name(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    wheel = dist / "torch_kvcanary-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"
    wheel.write_bytes(b"a wheel")
    _sdist(dist / "torch_kvcanary-0.1.0.tar.gz", list(release.SDIST_MEMBERS))
    release.index(dist, tmp_path / "index")
    page = (tmp_path / "index" / "torch-kvcanary" / "index.html").read_text()  # PEP 503: lower case, '_' as '-'
    links = dict(re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', page))
    assert set(links) == {wheel.name, "torch_kvcanary-0.1.0.tar.gz"}
    for name, digest in links.items():
        copied = tmp_path / "index" / "torch-kvcanary" / name
        assert digest == hashlib.sha256((dist / name).read_bytes()).hexdigest() == hashlib.sha256(copied.read_bytes()).hexdigest()
    assert 'href="torch-kvcanary/"' in (tmp_path / "index" / "index.html").read_text()


def test_an_empty_dist_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="kv-canary: nothing to index"):
        release.index(tmp_path, tmp_path / "index")


def test_an_sdist_without_the_build_or_the_tests_is_refused(tmp_path, capsys):
    complete = tmp_path / "complete.tar.gz"
    _sdist(complete, list(release.SDIST_MEMBERS))
    release.sdist(complete)
    assert "with the sources, the build and the tests" in capsys.readouterr().out
    for missing in ("build_tools/build_ext.py", "tests/data/fold_vectors.json", "LICENSE"):
        partial = tmp_path / "partial.tar.gz"
        _sdist(partial, [member for member in release.SDIST_MEMBERS if member != missing])
        with pytest.raises(SystemExit, match=f"kv-canary: partial.tar.gz lacks \\['{re.escape(missing)}'\\]: list them in MANIFEST.in"):
            release.sdist(partial)
