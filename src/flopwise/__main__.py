from flopwise.cli import main

main()
