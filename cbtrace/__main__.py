from cbtrace.cli import main

main()
