package main

// legacyMeta: arm64 has only the *at forms.
func legacyMeta(string) []string { return nil }
