//! The optimizers' configurations ([`Sgd`], [`Adam`], [`OptimizerConfig`]):
//! their hyper-parameters, validation, and how a configuration travels to
//! the parameters' owners.

use crate::error::{Error, Result};
use crate::value::Payload;

/// Stochastic gradient descent, as `torch.optim.SGD`: with weight decay `w`,
/// momentum `m`, dampening `d` and learning rate `lr`, each step computes
/// `g = grad + w * p`, `b = g` (first step) or `b = m * b + (1 - d) * g`,
/// `g = b` (or `g + m * b` with Nesterov), and `p -= lr * g`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 for none).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// With momentum `m`.
    pub fn momentum(mut self, m: f64) -> Self {
        self.momentum = m;
        self
    }

    /// With dampening `d`.
    pub fn dampening(mut self, d: f64) -> Self {
        self.dampening = d;
        self
    }

    /// With weight decay `w`.
    pub fn weight_decay(mut self, w: f64) -> Self {
        self.weight_decay = w;
        self
    }

    /// With Nesterov momentum.
    pub fn nesterov(mut self, on: bool) -> Self {
        self.nesterov = on;
        self
    }
}

/// Adam, as `torch.optim.Adam` (without amsgrad): with `g = grad + w * p`,
/// `m = b1 * m + (1 - b1) * g`, `v = b2 * v + (1 - b2) * g²`, and at step
/// `t`, `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the denominator for stability.
    pub eps: f64,
    /// L2 penalty.
    pub weight_decay: f64,
}

impl Adam {
    /// Adam with learning rate `lr` and PyTorch's defaults (betas
    /// `(0.9, 0.999)`, eps `1e-8`, no weight decay).
    pub fn new(lr: f64) -> Self {
        Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    /// With betas `(b1, b2)`.
    pub fn betas(mut self, b1: f64, b2: f64) -> Self {
        self.betas = (b1, b2);
        self
    }

    /// With eps `eps`.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// With weight decay `w`.
    pub fn weight_decay(mut self, w: f64) -> Self {
        self.weight_decay = w;
        self
    }
}

/// Which local optimizer each owner runs, with its hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// [`Sgd`].
    Sgd(Sgd),
    /// [`Adam`].
    Adam(Adam),
}

impl From<Sgd> for OptimizerConfig {
    fn from(s: Sgd) -> Self {
        OptimizerConfig::Sgd(s)
    }
}

impl From<Adam> for OptimizerConfig {
    fn from(a: Adam) -> Self {
        OptimizerConfig::Adam(a)
    }
}

impl OptimizerConfig {
    /// Checks the hyperparameters with `torch.optim`'s texts.
    ///
    /// # Errors
    /// `ValueError` "Invalid learning rate: ...", "Invalid momentum value:
    /// ...", "Invalid weight_decay value: ...", "Nesterov momentum requires
    /// a momentum and zero dampening", "Invalid epsilon value: ...",
    /// "Invalid beta parameter at index N: ...".
    pub fn validate(&self) -> Result<()> {
        let (lr, wd) = match self {
            OptimizerConfig::Sgd(s) => (s.lr, s.weight_decay),
            OptimizerConfig::Adam(a) => (a.lr, a.weight_decay),
        };
        if lr.is_nan() || lr < 0.0 {
            return Err(Error::value(format!("Invalid learning rate: {lr}")));
        }
        if wd.is_nan() || wd < 0.0 {
            return Err(Error::value(format!("Invalid weight_decay value: {wd}")));
        }
        match self {
            OptimizerConfig::Sgd(s) => {
                if s.momentum.is_nan() || s.momentum < 0.0 {
                    return Err(Error::value(format!(
                        "Invalid momentum value: {}",
                        s.momentum
                    )));
                }
                if s.nesterov && (s.momentum <= 0.0 || s.dampening != 0.0) {
                    return Err(Error::value(
                        "Nesterov momentum requires a momentum and zero dampening",
                    ));
                }
            }
            OptimizerConfig::Adam(a) => {
                if a.eps.is_nan() || a.eps < 0.0 {
                    return Err(Error::value(format!("Invalid epsilon value: {}", a.eps)));
                }
                for (i, b) in [a.betas.0, a.betas.1].into_iter().enumerate() {
                    if !(0.0..1.0).contains(&b) {
                        return Err(Error::value(format!(
                            "Invalid beta parameter at index {i}: {b}"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    pub(crate) fn to_payload(self) -> Payload {
        let f = Payload::from;
        match self {
            OptimizerConfig::Sgd(s) => Payload::tuple([
                Payload::from("sgd"),
                f(s.lr),
                f(s.momentum),
                f(s.dampening),
                f(s.weight_decay),
                Payload::from(s.nesterov),
            ]),
            OptimizerConfig::Adam(a) => Payload::tuple([
                Payload::from("adam"),
                f(a.lr),
                f(a.betas.0),
                f(a.betas.1),
                f(a.eps),
                f(a.weight_decay),
            ]),
        }
    }

    /// The configuration a guest sends ([`Self::to_payload`]'s form).
    pub(crate) fn from_payload(p: &Payload) -> Result<Self> {
        let items = p.items()?;
        let num = |i: usize| -> Result<f64> {
            items
                .get(i)
                .ok_or_else(|| Error::type_error("malformed optimizer configuration"))?
                .as_float()
        };
        let kind = items
            .first()
            .ok_or_else(|| Error::type_error("malformed optimizer configuration"))?
            .as_str()?
            .to_string();
        let config = match kind.as_str() {
            "sgd" => OptimizerConfig::Sgd(Sgd {
                lr: num(1)?,
                momentum: num(2)?,
                dampening: num(3)?,
                weight_decay: num(4)?,
                nesterov: items
                    .get(5)
                    .ok_or_else(|| Error::type_error("malformed optimizer configuration"))?
                    .as_bool()?,
            }),
            "adam" => OptimizerConfig::Adam(Adam {
                lr: num(1)?,
                betas: (num(2)?, num(3)?),
                eps: num(4)?,
                weight_decay: num(5)?,
            }),
            other => {
                return Err(Error::value(format!("unknown local optimizer {other:?}")));
            }
        };
        config.validate()?;
        Ok(config)
    }
}
