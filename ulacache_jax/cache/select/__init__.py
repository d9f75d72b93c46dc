"""Page-selection rules: which pages of a sequence a decode step attends (Quest's min/max bound, a key copy)."""
