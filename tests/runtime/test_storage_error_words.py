"""The one-line storage error names the operating system's words wherever the storage library put them."""

from rlhf_jax.runtime.checkpoint import _os_error


def test_the_systems_words_are_found_with_or_without_their_code():
    coded = ValueError('DATA_LOSS: Error writing "a/b" in OCDBT database: No space left on device [os_error_code=28]')
    assert _os_error(coded) == "No space left on device"
    # a zarr metadata write whose first line stops at the file name (seen in a run with files limited to 64 KiB)
    apart = ValueError('OUT_OF_RANGE: Error opening "zarr" driver: Error writing "1.2.count/.zarray" in OCDBT '
                       'database at local file "/x/ocdbt.process_0/": Failed writing: "\n/x/d/abc": File too large')
    assert _os_error(apart) == "File too large"
    assert _os_error(RuntimeError("INTERNAL: something else\nmore")) == "RuntimeError: INTERNAL: something else"
