"""Evaluations the papers use: AR-Hit/Others, needle retrieval, attention noise, MQAR, in-context learning."""
