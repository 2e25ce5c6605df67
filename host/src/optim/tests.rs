//! Tests of `optim`.

use super::*;

#[test]
fn configs_round_trip_and_validate() {
    for c in [
        OptimizerConfig::from(Sgd::new(0.1).momentum(0.9).weight_decay(0.01)),
        OptimizerConfig::from(Adam::new(0.01).betas(0.8, 0.99).eps(1e-6)),
    ] {
        assert_eq!(OptimizerConfig::from_payload(&c.to_payload()).unwrap(), c);
    }
    let e = OptimizerConfig::from(Sgd::new(-1.0))
        .validate()
        .unwrap_err();
    assert_eq!(e.message(), "Invalid learning rate: -1");
    let e = OptimizerConfig::from(Sgd::new(0.1).nesterov(true))
        .validate()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "Nesterov momentum requires a momentum and zero dampening"
    );
    let e = OptimizerConfig::from(Adam::new(0.1).betas(1.0, 0.9))
        .validate()
        .unwrap_err();
    assert_eq!(e.message(), "Invalid beta parameter at index 0: 1");
}
