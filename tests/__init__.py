"""The test suite; its folders mirror the package's (tests/engine/ tests pagedserve/engine/)."""
