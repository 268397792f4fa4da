#!/bin/sh
# Host discovery for jobs/elastic.yaml: print one `host:slots` per line, every time horovodrun asks.
# Replace with your cluster's query (e.g. a cloud API or a file your scheduler keeps up to date).
echo "localhost:2"
