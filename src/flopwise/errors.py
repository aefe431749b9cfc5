"""User-facing errors: one line that names the field and the fix; the CLI prints them without a
traceback and exits with code 2."""


class FlopwiseError(Exception):
    """A problem the user can fix (bad config, bad data, bad checkpoint). `quiet`: another rank of
    the job says it, so this one exits (code 2) without repeating it."""

    quiet = False


class ConfigError(FlopwiseError):
    pass


class DataError(FlopwiseError):
    pass


class CheckpointError(FlopwiseError):
    pass


class TrainingStopped(FlopwiseError):
    """Training cannot usefully go on (rollback cap, hung collective); the message says what to do."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet
