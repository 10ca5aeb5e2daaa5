"""embshard drops the library notices of embshard/runtime/notices.py, by their exact source and text, and nothing else."""

import logging
import warnings

import embshard  # noqa: F401  (installs the filters)
from embshard.runtime import notices


def test_listed_warnings_are_dropped_and_others_kept():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded, then embshard's filters in front of that
        notices.install()
        for prefix in notices.DROPPED_WARNINGS:
            warnings.warn(prefix + " and the rest of the text", UserWarning, stacklevel=1)
        warnings.warn("a warning of another library: " + notices.DROPPED_WARNINGS[0], UserWarning, stacklevel=1)
        warnings.warn(notices.DROPPED_WARNINGS[0], DeprecationWarning, stacklevel=1)  # another category stays visible
    assert [str(w.message) for w in caught] == [
        "a warning of another library: " + notices.DROPPED_WARNINGS[0],
        notices.DROPPED_WARNINGS[0],
    ]


def test_listed_log_records_are_dropped_and_others_kept(caplog):
    for name, prefix in notices.DROPPED:
        logger = logging.getLogger(name)
        with caplog.at_level(logging.INFO, logger=name):
            logger.warning(prefix + " (once per process)")
            logger.warning("another record of the same logger")
        assert [r.getMessage() for r in caplog.records] == ["another record of the same logger"]
        caplog.clear()


def test_fbgemm_compat_notice_is_dropped_as_it_prints_and_its_incompatibility_warning_kept(caplog):
    """fbgemm-gpu logs both on the root logger, coloured and indented (its __init__'s version check)."""
    missing = "\n            \033[33m\n            _fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;\n"
    wrong = "\n            \033[31m\n            FBGEMM_GPU version is 1.6.0, which is not guaranteed to be\n"
    with caplog.at_level(logging.WARNING):
        logging.warning(missing)
        logging.warning(wrong)
    assert [r.getMessage() for r in caplog.records] == [wrong]
