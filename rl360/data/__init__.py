"""Prompts from parquet: streaming, validation, chat rendering."""

from rl360.data.render import PromptRenderer
from rl360.data.schema import DataError, validate_file_schema, validate_row
from rl360.data.stream import PromptStream, expand_paths, scan_data_sources

__all__ = ["DataError", "PromptRenderer", "PromptStream", "expand_paths", "scan_data_sources",
           "validate_file_schema", "validate_row"]
