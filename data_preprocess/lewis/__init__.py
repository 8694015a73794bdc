"""The Lewis signalling game's data: games of candidate images with one target, as speaker and listener rows."""
