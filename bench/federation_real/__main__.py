from bench.federation_real.run import main

raise SystemExit(main())
