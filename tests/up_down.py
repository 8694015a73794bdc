"""`UpDown`: a context manager over a test fixture's `up()` and `down()` (network namespaces, a Slurm cluster):
`down()` runs when the block ends and also when `up()` fails half way, so nothing it started is left."""

from __future__ import annotations


class UpDown:
    def up(self) -> None:
        raise NotImplementedError

    def down(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()
