"""Logic puzzles: the answer goes inside the last <answer> … </answer> of the response."""
