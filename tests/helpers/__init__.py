"""What several test modules share: tiny models built here (``models``) and kernel fixtures
(``kernels``). Imported as ``tests.helpers``: the repository root is on pytest's path."""
