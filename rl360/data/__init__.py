"""Prompts from parquet: streaming, mixing by weight, validation, chat rendering, inspection."""

from rl360.data.mix import MixedPromptStream
from rl360.data.render import PromptRenderer
from rl360.data.schema import DataError, validate_file_schema, validate_row
from rl360.data.stream import PromptStream, expand_paths, scan_data_sources

__all__ = ["DataError", "MixedPromptStream", "PromptRenderer", "PromptStream", "expand_paths", "scan_data_sources",
           "validate_file_schema", "validate_row"]
