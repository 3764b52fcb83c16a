import pytest

from kvtier.units import format_size, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), (4096, 4096), ("0", 0), ("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30),
    ("4gib", 4 * 2**30), ("1.5GiB", 3 * 2**29), ("100GB", 100 * 10**9), ("2 TiB", 2 * 2**40),
    ("64kb", 64000), ("64KiB", 65536), ("7b", 7), ("7B", 7), ("0.5KiB", 512), (8192.0, 8192),
    (str(2**60), 2**60),
])
def test_parse_size_accepts_common_spellings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "-1", -1, "1e3", "four", True, "4 G iB", "64k", "4G",
                                  "1.5", 1.5, float("nan"), float("inf"), -2.0, "\u0663", 2**60 + 1])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size_picks_binary_units():
    assert format_size(0) == "0 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(4 * 2**30) == "4 GiB"
    assert format_size(3 * 2**40) == "3 TiB"


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800),
                                               ("1.5h", 5400), ("7d", 604800), ("2w", 1209600),
                                               ("250ms", 0.25)])
def test_parse_duration(text, seconds):
    from kvtier.units import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "3 days", "-1s", "5sm", "inf", "nan", "9" * 400, float("inf")])
def test_parse_duration_rejects_garbage(text):
    from kvtier.units import parse_duration

    with pytest.raises(ValueError):
        parse_duration(text)
