"""What a step costs before it runs: the dry run, the predicted step over GPU figures, the
compiled-HLO reader."""
